"""The control plane: typed messages (``messages``: one frozen dataclass per type, fixed drop
reasons) and their envelope (``wire``: signed sender, recipient, nonce and sequence), the control
channel (``channel``, its bounded replay state in ``peers``), the HELLO exchange (``handshake``)
and launch-time compatibility in words (``compat``), HMAC (``auth``), bind vs advertise
(``addresses``), and the bootstrap registry: its state (``registry``), its client (``client``,
standard library only) and its server (``bootstrap``, aiohttp, imported only by the process that
runs it).
"""

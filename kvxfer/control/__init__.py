"""The control plane: typed wire messages (``wire``), the control channel (``channel``), the HELLO
exchange (``handshake``) and launch-time compatibility in words (``compat``), HMAC (``auth``), and the
bootstrap registry: its client (``client``, standard library only) and its server (``bootstrap``,
aiohttp, imported only by the process that runs it).
"""

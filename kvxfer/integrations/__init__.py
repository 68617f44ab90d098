"""Adapters that serving engines load from outside: ``kvxfer.integrations.vllm`` (a vLLM KV
connector, ``kv_connector_module_path``) and ``kvxfer.integrations.sglang`` (an SGLang transfer
backend, through SGLang's ``sglang.srt.plugins`` entry points). Each imports its engine only when
the engine loads it; ``import kvxfer`` never imports an engine, and kvxfer never depends on one.
"""

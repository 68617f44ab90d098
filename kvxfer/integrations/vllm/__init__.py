"""kvxfer as a vLLM KV connector (being built; see issue 36)."""

"""graphsafe attached to the engines users already run (`graphsafe.integrations.vllm`)."""

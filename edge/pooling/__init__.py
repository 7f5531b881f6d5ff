"""The pooling endpoints: `/v1/embeddings`, `/pooling`, `/score` and `/rerank` (vLLM's paths and
shapes), their request and response bodies, and running them on the engine's pooling API.
"""

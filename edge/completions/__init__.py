"""The OpenAI completion endpoints: `/v1/completions` and `/v1/chat/completions`, their request
shapes, generation, SSE streams and logprob shapes.
"""

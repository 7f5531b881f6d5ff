"""The OpenAI Responses API: `/v1/responses`, its request and output shapes, the plan that turns a
request into generations and tool rounds, and the store of earlier responses.
"""

"""Tool calling shared by chat completions and responses: the request's tools, the call format a
model writes, and MCP tool servers.
"""

"""The KV connector's worker side: the transfer a rank runs for disaggregated prefill. A producer's
KV server (`transport`), the shared-memory path between instances on one host (`shm`), the
consumer's pool of loads (`loader`) and the connector that ties them to the model runner's cache
(`connector`).
"""

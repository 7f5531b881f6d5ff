"""Speculative decoding's engine-core side: proposals without a draft model (`ngram`, `suffix`),
which requests propose how many tokens each step (`drafter`), and the `--speculative-config`
that sets them (`config`). The runner verifies the proposals (`triode.gpu.rejection_sampler`).
"""

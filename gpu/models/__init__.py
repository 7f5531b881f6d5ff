"""The model families: each a decoder built from `layers`' tensor-parallel blocks over the paged
`attention`, loading Hugging Face checkpoints by name (`registry` picks one by architecture)."""

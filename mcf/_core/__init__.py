"""The shared core of mcf: what every format builds on and nothing format-specific.

Modules here import only each other, :mod:`mcf.errors` and the standard library / numpy; the formats
(MCF, Megatron, MegaContext, bucket, GGUF) import them, never the other way round.  See
docs/architecture.md for the layers.
"""

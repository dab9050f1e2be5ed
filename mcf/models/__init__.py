"""Plain-numpy forward passes of the models mcf's own tools run (no torch, no transformers).

:mod:`mcf.models.bert` runs BERT encoders such as the demo's all-MiniLM-L6-v2: the demo stores its real
keys and values in a bucket, and :func:`mcf.imatrix.collect_bert` measures importance matrices with it.
They take the weights as arrays (their callers read them from MCF or safetensors files) and sit
with the converters in docs/architecture.md's layers.
"""

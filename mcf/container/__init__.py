"""MCF, the Model Container Format: the format's own modules.

- :mod:`mcf.container.layout`: the byte layouts (header, section directory, quantized block sizes);
- :mod:`mcf.container.reader`: :func:`mcf.open` and :class:`mcf.Container`;
- :mod:`mcf.container.writer`: :class:`mcf.Writer`;
- :mod:`mcf.container.tensor_index`, :mod:`mcf.container.modelinfo`, :mod:`mcf.container.quantinfo`:
  the TensorIndex, ModelInfo and QuantInfo sections;
- :mod:`mcf.container.quant`: block quantization of arrays (:func:`mcf.quantize`, :func:`mcf.dequantize`);
- ``mcf.container._index``: the compiled tensor-index parser.

The public names are the package's (``mcf.open``, ``mcf.Writer``, ...); this package only groups the
modules, so it re-exports nothing.  See docs/mcf.md for the format and docs/architecture.md for the layers.
"""

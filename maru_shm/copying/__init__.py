"""Moving bytes between the pool and callers' buffers, on the cores nothing else keeps busy.

pieces: scatter/gather lists of a batch; copyplan: pieces as strided runs; copyengine: one batch of raw
copies on several threads; idlecores: how many threads it may use. Nothing here knows the file format.
"""

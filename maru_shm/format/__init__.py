"""The file format (docs/FORMAT.md): what every byte of a pool file means, and nothing that acts on it.

records: how a mapped record is declared; layout: every record, the lock ids, the block meta word;
geometry: where the regions lie, the superblock; sizeclasses: the classes creation writes.
"""

"""The tiers behind MaruStorage: the pool as the near tier, Mooncake Store as the second, and the two as one.

local: the pool as the near tier, every KV page I/O and its counts; second: Mooncake Store's life, its
thread and its guarded calls; twotiers: read-through, promotion, write-through; status: the status files
`maru-shm inspect` reads.
"""

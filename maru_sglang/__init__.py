"""maru_sglang: SGLang HiCache L3 storage backend on a maru_shm pool.

Load it with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "maru", "module_path": "maru_sglang.maru_storage",
        "class_name": "MaruStorage", "interface_v1": 1}'
"""

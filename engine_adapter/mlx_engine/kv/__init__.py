"""The engine's KV: per-sequence KV and snapshots (``cache.py``), snapshots of sliding-window and
recurrent layers (``layered.py``), the RAM stores and the radix index (``store.py``), a RAM store
over the disk tier (``tiered.py``), and the disk tier itself (``disk.py``) with its files
(``file.py``), folder (``folder.py``), keys (``disk_keys.py``), start-up scan (``disk_scan.py``),
setup (``disk_setup.py``) and the model fingerprint (``fingerprint.py``).
"""

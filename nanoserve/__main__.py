"""``python -m nanoserve``: the server (see nanoserve/entry.py)."""
from nanoserve.entry import main

raise SystemExit(main())

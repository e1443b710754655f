"""The `thaw` command line (main.py) and its in-process commands: `thaw invoke`
(invoke.py) and `thaw coldstart` (coldstart.py).

May import anything in runtime/; it is the top of the tree.
"""

"""The `thaw` command line (main.py) and its commands: `thaw invoke` (invoke.py),
`thaw coldstart` (coldstart.py), `thaw bundle build` (bundle.py), `thaw init`
(init.py, from the templates in runtime/templates/) and `thaw image build`
(image.py, with wheelhouse.py, which scripts/image.py shares).

May import anything in runtime/; it is the top of the tree.
"""

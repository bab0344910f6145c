"""Generated code for package pie.v1; regenerate with `python clients/codegen.py`."""

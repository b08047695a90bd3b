r"""
pytest plugin shipped with qcomm (entry point ``pytest11``): gives every test
suite the ``qcomm`` fixtures of the conformance kit.

Importing it is cheap: torch and the kit load only when a fixture is used.
"""

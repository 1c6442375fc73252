from spotrun.server import PrefectServer, free_port  # noqa: F401 (re-exported for the tests)

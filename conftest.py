"""Root conftest: load the ladder's pytest plugin (options, markers, fixtures live in ladder/plugin/__init__.py)."""

pytest_plugins = ["ladder.plugin"]

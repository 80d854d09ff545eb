"""Root conftest: load the ladder's pytest plugin (options, markers, fixtures live in ladder/plugin.py)."""

pytest_plugins = ["ladder.plugin"]

"""Test markers: `families` marks the whole layout matrix of the VLM families' training (run by
`make test-families`; `make test` deselects it)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "families: the VLM families' full layout matrix (make test-families)")

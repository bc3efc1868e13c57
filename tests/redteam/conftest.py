def pytest_configure(config):
    config.addinivalue_line("markers", "redteam: the red-team corpus run through the final evaluation (slow)")

"""Shared pytest configuration."""
import warnings


def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'slow: end-to-end tests (training runs, builds); part of '
        '`make test`, excluded by `make test-fast`')
    warnings.filterwarnings('ignore', category=DeprecationWarning)

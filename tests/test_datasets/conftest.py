"""Synthetic raw downloads shared by the dataset tests (generated once)."""
import pytest

from .helpers import COUNTS, IMG_SIZE

import make_synthetic_lesions as gen  # isort:skip (path set by helpers)


@pytest.fixture(scope='session')
def raw_copy(tmp_path_factory):
    """``raw_copy(layout, as_zip=False)``: path of a synthetic download.

    Shared by tests: read it, never modify it.
    """
    cache = {}

    def get(layout: str, as_zip: bool = False) -> str:
        if (layout, as_zip) not in cache:
            out = tmp_path_factory.mktemp('raw') / layout
            cache[layout, as_zip] = gen.make_dataset(
                str(out), layout, COUNTS[layout], img_size=IMG_SIZE,
                as_zip=as_zip)
        return cache[layout, as_zip]

    return get

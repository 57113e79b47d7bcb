import pytest


@pytest.fixture
def anyio_backend() -> str:
    # exo runs on asyncio only.
    return "asyncio"

import pytest


@pytest.fixture(scope="session")
def demo_model() -> str:
    from workers.models.demo import ensure_demo_model
    return str(ensure_demo_model())

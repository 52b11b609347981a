"""``aio.engines.set_auto_engine``: what ``engine="auto"`` builds in this process (one-shot commands on small
sources take the thread engine: a kernel AIO context costs its process ~35 ms when it ends)."""

from __future__ import annotations

from typing import Iterator, Literal

import pytest

from aio import AioConfig
from aio.engines import LibaioEngine, ThreadEngine, create_engine, libaio_status, set_auto_engine


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    set_auto_engine(None)


def _built(config: AioConfig) -> type:
    engine = create_engine(config)
    try:
        return type(engine)
    finally:
        engine.close()


def test_threads_makes_auto_the_thread_engine_and_leaves_explicit_choices_alone() -> None:
    set_auto_engine("threads")
    assert _built(AioConfig()) is ThreadEngine
    assert _built(AioConfig(engine="threads")) is ThreadEngine
    if libaio_status()[0]:
        assert _built(AioConfig(engine="libaio")) is LibaioEngine  # asked for by name: still libaio


@pytest.mark.skipif(not libaio_status()[0], reason="kernel AIO unavailable here")
def test_none_and_libaio_give_auto_back_its_preference() -> None:
    choices: tuple[Literal["libaio"] | None, ...] = (None, "libaio")
    for choice in choices:
        set_auto_engine("threads")
        set_auto_engine(choice)
        assert _built(AioConfig()) is LibaioEngine

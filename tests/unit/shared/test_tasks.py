"""shared.tasks: fire-and-forget tasks are held until they end, and can be called off together."""

import asyncio

from shared.tasks import BackgroundTasks


async def test_cancel_calls_off_every_task_and_each_runs_its_cleanup() -> None:
    tasks = BackgroundTasks()
    cleaned: list[int] = []

    async def runs_on(index: int) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cleaned.append(index)
            raise

    for index in range(3):
        tasks.spawn(runs_on(index))
    await asyncio.sleep(0)
    tasks.cancel()
    async with asyncio.timeout(1):
        await tasks.wait()
    assert sorted(cleaned) == [0, 1, 2]


async def test_wait_returns_once_every_task_ended() -> None:
    tasks = BackgroundTasks()
    done: list[str] = []

    async def quick() -> None:
        await asyncio.sleep(0.01)
        done.append("quick")

    tasks.spawn(quick())
    async with asyncio.timeout(1):
        await tasks.wait()
    assert done == ["quick"]

import anyio
import pytest

from exo.utils.channels import Subscription, Topic

DEADLINE_S = 5


@pytest.fixture
def anyio_backend() -> str:
    # exo runs on asyncio (anyio.run's default); trio is not a supported backend.
    return "asyncio"


def drain(subscription: Subscription[int]) -> list[int]:
    items: list[int] = []
    while True:
        try:
            items.append(subscription.receive_nowait())
        except anyio.WouldBlock:
            return items


def test_every_subscriber_gets_every_item_in_order() -> None:
    topic: Topic[int] = Topic("numbers")
    first, second = topic.subscribe(), topic.subscribe()
    publisher = topic.sender()
    for item in range(100):
        publisher.publish(item)
    assert drain(first) == list(range(100))
    assert drain(second) == list(range(100))


def test_a_late_subscriber_only_gets_later_items() -> None:
    topic: Topic[int] = Topic("numbers")
    early = topic.subscribe()
    topic.publish(1)
    late = topic.subscribe()
    topic.publish(2)
    assert drain(early) == [1, 2]
    assert drain(late) == [2]


def test_publish_without_subscribers_is_dropped() -> None:
    topic: Topic[int] = Topic("numbers")
    topic.publish(1)
    subscription = topic.subscribe()
    assert drain(subscription) == []


def test_closed_subscriber_is_removed_without_breaking_publish() -> None:
    topic: Topic[int] = Topic("numbers")
    first, closed, last = topic.subscribe(), topic.subscribe(), topic.subscribe()
    topic.publish(1)
    closed.close()
    topic.publish(2)
    topic.publish(3)
    assert drain(first) == [1, 2, 3]
    assert drain(last) == [1, 2, 3]
    with pytest.raises(anyio.ClosedResourceError):
        closed.receive_nowait()
    assert len(topic._subscribers) == 2


def test_all_subscribers_closed_leaves_a_usable_topic() -> None:
    topic: Topic[int] = Topic("numbers")
    for subscription in (topic.subscribe(), topic.subscribe()):
        subscription.close()
    topic.publish(1)
    assert topic._subscribers == []
    fresh = topic.subscribe()
    topic.publish(2)
    assert drain(fresh) == [2]


@pytest.mark.anyio
async def test_async_subscribers_receive_in_order() -> None:
    topic: Topic[int] = Topic("numbers")
    subscriptions = [topic.subscribe(), topic.subscribe()]
    received: list[list[int]] = [[], []]

    async def consume(index: int) -> None:
        async for item in subscriptions[index]:
            received[index].append(item)
            if item == 9:
                return

    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as task_group:
            for index in range(2):
                task_group.start_soon(consume, index)
            await anyio.wait_all_tasks_blocked()  # both consumers wait on an empty stream
            publisher = topic.sender()
            for item in range(10):
                publisher.publish(item)
    assert received == [list(range(10)), list(range(10))]


@pytest.mark.anyio
async def test_receive_waits_for_a_publish() -> None:
    topic: Topic[str] = Topic("words")
    subscription = topic.subscribe()
    received: list[str] = []

    async def consume() -> None:
        received.append(await subscription.receive())

    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            assert received == []
            topic.publish("hello")
    assert received == ["hello"]

"""prefix_slots.pick_slot, the engine's prefix cache choice, on small slot tables: the free slot with the
longest common prefix, the least recently used among equals, and a busy slot's rows (only those it
holds now) when they share more."""

from localllm.prefix_slots import pick_slot

PROMPT = [1, 2, 3, 4, 5]


def test_longest_prefix_among_free_slots():
    held = [[1, 2], [1, 2, 3, 9], [7], [1, 2, 3, 4, 5, 6]]
    # slot 3 shares all 5 ids but is busy and its rows hold only 2 of them now: slot 1's 3 win
    assert pick_slot(PROMPT, held, [0, 0, 0, 2], {3: None}, [4, 3, 2, 1]) == (1, 3, -1)


def test_least_recently_used_on_a_tie():
    held = [[1, 2, 8], [9], [1, 2, 7], [1, 2]]
    assert pick_slot(PROMPT, held, [0, 0, 0, 0], {}, [5, 1, 2, 3]) == (2, 2, -1)


def test_busy_slot_sharing_more_is_copied_into_the_oldest_free_slot():
    held = [[1, 2], [1, 2, 3, 4, 5, 6], [8], [1]]
    # busy slot 1 holds 5 rows now: its 5 shared ids beat slot 0's 2; the copy goes to the least
    # recently used free slot (3), keeping slot 0's prefix and slot 2's
    assert pick_slot(PROMPT, held, [0, 5, 0, 0], {1: None}, [3, 4, 2, 1]) == (3, 5, 1)

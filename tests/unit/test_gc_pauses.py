"""The process's garbage-collection pause recorder (paged_llm/gc_pauses.py)."""

from __future__ import annotations

import gc

from paged_llm.gc_pauses import GcPauses, process_gc_pauses


def test_collections_are_counted_once_per_process_however_often_it_is_asked():
    before = process_gc_pauses()
    process_gc_pauses()  # a second engine in the process: still one recorder
    gc.collect()
    gc.collect(0)
    after = process_gc_pauses().since(before)
    assert after.num_collections == 2
    assert after.pause_s_total > 0 and after.longest_pause_s > 0
    assert sum(callback.__class__.__name__ == "_Recorder" for callback in gc.callbacks) == 1


def test_since_subtracts_everything_but_the_longest_pause():
    later = GcPauses(5, 0.5, 2, 0.2).since(GcPauses(3, 0.1, 1, 0.05))
    assert later == GcPauses(2, 0.4, 1, 0.2)

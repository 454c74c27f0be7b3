from api.downsample import dedupe_steps, downsample


def test_lttb_keeps_ends_and_the_spike() -> None:
    steps = list(range(1, 1001))
    values = [1.0] * 1000
    values[500] = 50.0
    s, v = downsample(steps, values, max_points=20)
    assert len(s) == 20 and s[0] == 1 and s[-1] == 1000
    assert 50.0 in v, "LTTB keeps the largest triangle: the spike"


def test_short_series_are_returned_whole_and_duplicates_keep_the_last() -> None:
    assert downsample([1, 2, 3], [3.0, 2.0, 1.0], max_points=10) == ([1, 2, 3], [3.0, 2.0, 1.0])
    assert dedupe_steps([1, 2, 2, 3], [1.0, 2.0, 2.5, 3.0]) == ([1, 2, 3], [1.0, 2.5, 3.0])

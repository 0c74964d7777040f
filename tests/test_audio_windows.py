import numpy as np

from engine.audio_windows import recognition_windows


def test_short_audio_is_one_window():
    assert recognition_windows(np.zeros(16000 * 3, np.float32), 16000, 30) == [(0, 48000)]


def test_long_audio_is_cut_in_the_quietest_place_before_each_limit():
    rate = 1000
    loud = np.random.default_rng(0).normal(0, 0.5, 75 * rate).astype(np.float32)
    loud[27_000:27_300] = 0  # a pause inside the first window's last 5 s
    windows = recognition_windows(loud, rate, 30)
    assert windows[0][0] == 0 and 27_000 <= windows[0][1] <= 27_300
    assert all(end - start <= 30 * rate for start, end in windows)
    assert [w[1] for w in windows[:-1]] == [w[0] for w in windows[1:]]  # contiguous
    assert windows[-1][1] == len(loud)


def test_empty_audio_is_one_empty_window():
    assert recognition_windows(np.zeros(0, np.float32), 16000, 30) == [(0, 0)]

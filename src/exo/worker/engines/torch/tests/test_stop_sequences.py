from exo.worker.engines.torch.decoding.stop_sequences import StopCheck, StopSequenceMatcher


def feed_all(matcher: StopSequenceMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    emitted: list[str] = []
    for piece in pieces:
        check = matcher.feed(piece)
        emitted.append(check.text)
        if check.stopped:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_no_stop_sequences_passes_text_through() -> None:
    matcher = StopSequenceMatcher([])
    assert matcher.feed("hello") == StopCheck("hello", False)


def test_stop_split_across_pieces_is_never_emitted() -> None:
    matcher = StopSequenceMatcher(["<|end|>"])
    emitted, stopped = feed_all(matcher, ["Hello <|", "en", "d|> ignored"])
    assert stopped
    assert "".join(emitted) == "Hello "
    assert all("<|" not in text for text in emitted)


def test_text_before_stop_in_same_piece_is_emitted() -> None:
    matcher = StopSequenceMatcher(["STOP"])
    assert matcher.feed("abc STOP def") == StopCheck("abc ", True, "STOP")


def test_partial_prefix_is_held_then_released() -> None:
    matcher = StopSequenceMatcher(["###"])
    assert matcher.feed("a #") == StopCheck("a ", False)
    assert matcher.held_text == "#"
    assert matcher.feed("#") == StopCheck("", False)
    assert matcher.feed("x") == StopCheck("##x", False)
    assert matcher.held_text == ""


def test_held_text_is_flushed_at_end() -> None:
    matcher = StopSequenceMatcher(["</s>"])
    emitted, stopped = feed_all(matcher, ["one </", "s"])
    assert not stopped
    assert emitted == ["one ", "", "</s"]


def test_earliest_of_several_stop_sequences_wins() -> None:
    matcher = StopSequenceMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == StopCheck("hel", True, "lo w")


def test_stop_at_start_emits_nothing() -> None:
    matcher = StopSequenceMatcher(["\n\n"])
    assert matcher.feed("\n") == StopCheck("", False)
    assert matcher.feed("\nrest") == StopCheck("", True, "\n\n")


def test_overlapping_prefixes_keep_the_longest_candidate() -> None:
    matcher = StopSequenceMatcher(["aab"])
    assert matcher.feed("aa") == StopCheck("", False)
    assert matcher.feed("a") == StopCheck("a", False)
    assert matcher.feed("b") == StopCheck("", True, "aab")

from infero.engine.stop import StopChecker


def feed_all(stop, deltas, include_stop=False):
    c = StopChecker(stop, include_stop)
    out = "".join(c.feed(d) for d in deltas)
    return out + ("" if c.stopped else c.flush()), c.stopped


def test_stop_string_split_across_deltas_is_not_leaked():
    assert feed_all(["</answer>"], ["The answer", " is 4</", "ans", "wer> and more"]) == ("The answer is 4", True)


def test_text_is_held_back_only_while_it_could_start_a_stop_string():
    c = StopChecker(["STOP"])
    assert c.feed("abcdef") == "abc"
    assert c.feed("g") == "d"


def test_earliest_of_several_stop_strings_wins():
    assert feed_all(["xyz", "b"], ["a", "bxyz"]) == ("a", True)


def test_without_stop_strings_text_passes_straight_through():
    c = StopChecker(None)
    assert c.feed("hello") == "hello" and not c.stopped


def test_flush_releases_held_text_when_no_stop_came():
    assert feed_all(["###"], ["one #", "#"]) == ("one ##", False)


def test_include_stop_str_in_output_ends_the_text_with_the_earliest_longest_stop_string():
    assert feed_all(["</answer>"], ["The answer", " is 4</", "ans", "wer> and more"], True) == (
        "The answer is 4</answer>", True)  # fmt: skip
    assert feed_all(["xyz", "b"], ["a", "bxyz"], True) == ("ab", True)
    assert feed_all(["ab", "abc"], ["xabcd"], True) == ("xabc", True)

import json

import pytest

from training_core.config import DataSpec
from training_core.data.datasets import DatasetError, PromptLoader, load_data, load_rows
from training_core.data.synthetic import arithmetic_items, arithmetic_score

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A shop sells 1,200 pens and 34 more.", "answer": "1200+34=1234\n#### 1,234"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_synthetic_arithmetic_is_seeded_and_scored():
    a, b = arithmetic_items(5, 1), arithmetic_items(5, 1)
    assert a == b
    item = {"question": "7+12+5=", "answer": "24"}
    assert arithmetic_score("7,19,24", item) == 1.0
    assert arithmetic_score("7,19,25", item) == 0.0
    long = arithmetic_items(200, 2, min_terms=2, max_terms=6)
    assert {len(r["solution"].split(",")) for r in long} == {2, 3, 4, 5, 6}


def test_gsm8k_format_extracts_final_answers(tmp_path):
    rows = load_rows(f"gsm8k:{_write_jsonl(tmp_path / 'g.jsonl', GSM8K_ROWS)}", options={}, size=10, seed=0)
    assert [r["answer"] for r in rows] == ["7", "1234"]
    assert rows[0]["solution"].endswith("#### 7")


def test_gsm8k_row_without_final_answer_names_the_row(tmp_path):
    path = _write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS + [{"question": "q", "answer": "no marker"}])
    with pytest.raises(DatasetError, match="row 3.*####"):
        load_rows(f"gsm8k:{path}", options={}, size=10, seed=0)


def test_jsonl_parquet_csv_and_hf_disk_agree(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = [{"q": "1+1=", "a": "2"}, {"q": "2+2=", "a": "4"}]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("q,a\n1+1=,2\n2+2=,4\n")
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    for source in [f"jsonl:{tmp_path / 'd.jsonl'}", f"parquet:{tmp_path / 'd.parquet'}",
                   f"csv:{tmp_path / 'd.csv'}", f"hf_disk:{tmp_path / 'hf'}"]:
        got = load_rows(source, options={}, size=10, seed=0, question_field="q", answer_field="a")
        assert [(r["question"], r["answer"]) for r in got] == [("1+1=", "2"), ("2+2=", "4")], source


def test_bad_jsonl_line_is_reported_with_its_number(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"question": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        load_rows(f"jsonl:{tmp_path / 'bad.jsonl'}", options={}, size=10, seed=0)


def test_missing_field_suggests_the_mapping(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "1"}])
    with pytest.raises(DatasetError, match="question_field"):
        load_rows(f"jsonl:{tmp_path / 'd.jsonl'}", options={}, size=10, seed=0)


def test_reasoning_gym_generators():
    rows = load_rows("reasoning_gym:basic_arithmetic", options={}, size=3, seed=0)
    assert len(rows) == 3 and all(r["question"] and r["answer"] for r in rows)


def test_file_data_gets_a_held_out_split(tmp_path):
    rows = [{"question": f"{i}+0=", "answer": str(i)} for i in range(50)]
    spec = DataSpec(source=f"jsonl:{_write_jsonl(tmp_path / 'd.jsonl', rows)}", eval_size=5)
    data = load_data(spec, seed=0)
    assert len(data.eval) == 5 and len(data.train) == 45
    assert not {r["question"] for r in data.eval} & {r["question"] for r in data.train}


def test_prompt_loader_resumes_at_its_position():
    rows = [{"i": i} for i in range(7)]
    a = PromptLoader(rows, seed=3)
    first = [a.next()[1]["i"] for _ in range(10)]
    b = PromptLoader(rows, seed=3)
    b.position = 4
    assert [b.next()[1]["i"] for _ in range(6)] == first[4:]
    assert sorted(first[:7]) == list(range(7))  # one epoch covers every row once


# ---- held out by construction (issue 48) ---------------------------------------------------------

def test_a_generator_with_more_than_10007_rows_holds_its_eval_set_out():
    """reasoning-gym seeds item i with Random(seed + i): with the old eval seed, seed + 10_007,
    eval row j was training row 10_007 + j on any run with more rows than that."""
    from training_core.data.datasets import question_key

    spec = DataSpec(source="reasoning_gym:basic_arithmetic", size=10_100, eval_size=100)
    data = load_data(spec, seed=1)
    assert len(data.eval) == 100 and data.overlap == {"heldout": 0.0}
    asked = {question_key(r["question"]) for r in data.eval}
    assert not asked & {question_key(r["question"]) for r in data.train}
    # The streams are disjoint as seeds, not only after the text filter: no training row went.
    assert data.removed_from_train == 0 and len(data.train) == 10_100


def test_a_small_question_space_loses_its_eval_questions_from_training():
    # Two terms of 0..9: 100 questions; 20,000 training rows ask each of them many times.
    from training_core.data.datasets import overlap_fraction, question_key

    spec = DataSpec(options={"max_value": 9}, size=20_000, eval_size=10)
    data = load_data(spec, seed=0)
    asked = {question_key(r["question"]) for r in data.eval}
    assert len(asked) == len(data.eval) == 10  # each question once
    assert not asked & {question_key(r["question"]) for r in data.train}
    assert data.removed_from_train > 0 and data.overlap["heldout"] == 0.0
    assert overlap_fraction(data.eval, data.train) == 0.0
    # At most a fifth of the space is held out, whatever eval_size asks for.
    big = load_data(DataSpec(options={"max_value": 9}, size=20_000, eval_size=500), seed=0)
    assert len(big.eval) == 20 and len({question_key(r["question"]) for r in big.train}) == 80


def test_an_intended_overlap_is_kept_and_measured():
    spec = DataSpec(options={"max_value": 9}, size=20_000, eval_size=10, allow_eval_overlap=True)
    data = load_data(spec, seed=0)
    assert data.removed_from_train == 0 and len(data.train) == 20_000
    assert data.overlap["heldout"] == 1.0  # every question of this space is in the pool


def test_an_intended_overlap_keeps_a_files_eval_questions_in_the_pool(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(50)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    data = load_data(DataSpec(source=f"jsonl:{path}", eval_size=10, allow_eval_overlap=True),
                     seed=0)
    assert len(data.eval) == 10
    assert len(data.train) == 50 and data.overlap["heldout"] == 1.0


def test_an_overlap_the_spec_did_not_allow_is_an_error():
    from training_core.data.datasets import held_out

    rows = [{"question": f"{i}+0=", "answer": str(i)} for i in range(10)]
    # Removal leaves no overlap; an eval set that is all of the pool leaves nothing to train.
    with pytest.raises(DatasetError, match="data.eval_size.*data.allow_eval_overlap"):
        held_out(rows, {"heldout": rows[:]}, allow_overlap=False, source="x")
    data = held_out(rows, {"heldout": rows[:2]}, allow_overlap=False, source="x")
    assert data.overlap == {"heldout": 0.0} and len(data.train) == 8


def test_a_file_with_duplicate_questions_splits_by_question(tmp_path):
    from training_core.data.datasets import question_key

    # 30 distinct questions, each asked three times (case and spacing vary): a split by row
    # would put copies of one question on both sides.
    rows = [{"question": form.format(i), "answer": str(i)} for i in range(30)
            for form in ("What is {}+1?", "what is  {}+1?", "WHAT IS {}+1? ")]
    spec = DataSpec(source=f"jsonl:{_write_jsonl(tmp_path / 'd.jsonl', rows)}", eval_size=5)
    data = load_data(spec, seed=3)
    asked = [question_key(r["question"]) for r in data.eval]
    assert len(asked) == len(set(asked)) == 5  # each eval question once
    trained = {question_key(r["question"]) for r in data.train}
    assert not set(asked) & trained and len(trained) == 25
    assert len(data.train) == 75  # every copy of the 25 others is trained on
    assert data.overlap == {"heldout": 0.0}


def test_a_tiny_training_draw_keeps_its_eval_set():
    # One training row, 20 eval questions from a large space: none of them is in the pool, so
    # the fifth-of-the-pool rule takes nothing away (benchmarks/learning.py's scan draws so).
    data = load_data(DataSpec(size=1, eval_size=20), seed=0)
    assert len(data.eval) == 20 and len(data.train) == 1 and data.overlap["heldout"] == 0.0


def test_the_warm_start_never_sees_the_rl_runs_eval_questions(tmp_path):
    from training_core.data.datasets import question_key, warm_start_rows

    path = _write_jsonl(tmp_path / "d.jsonl",
                        [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(50)])
    for spec in (DataSpec(options={"max_value": 9}, size=5_000, eval_size=10),
                 DataSpec(source=f"jsonl:{path}", eval_size=10)):
        asked = {question_key(r["question"]) for r in load_data(spec, seed=4).eval}
        rows = warm_start_rows(spec, seed=4)
        assert asked and rows and not asked & {question_key(r["question"]) for r in rows}
        # in-sample on purpose: the warm start trains on them as the RL run does
        spec = spec.model_copy(update={"allow_eval_overlap": True})
        asked = {question_key(r["question"]) for r in load_data(spec, seed=4).eval}
        assert asked <= {question_key(r["question"]) for r in warm_start_rows(spec, seed=4)}


def test_trained_questions_measure_what_training_batches_held():
    from training_core.data.datasets import TrainedQuestions

    # In-sample on purpose: the eval questions stay in the pool, so batches come to hold them.
    data = load_data(DataSpec(options={"max_value": 9}, size=2_000, eval_size=10,
                              allow_eval_overlap=True), seed=0)
    seen = TrainedQuestions(data.train, seed=0)
    assert seen.fraction(data.eval) == 0.0
    seen.add(list(range(2_000)) + [-1])  # an epoch of the pool; -1: a group without a prompt
    assert seen.fraction(data.eval) == 1.0
    # The stream index maps to the row the run's own loader hands out.
    loader = PromptLoader(data.train, seed=0)
    one = TrainedQuestions(data.train, seed=0)
    one.add([5])
    assert one.fraction([loader.row(5)]) == 1.0
    held = load_data(DataSpec(options={"max_value": 9}, size=2_000, eval_size=10), seed=0)
    everything = TrainedQuestions(held.train, seed=0)
    everything.add(list(range(4_000)))
    assert everything.fraction(held.eval) == 0.0


def test_named_eval_sets_leave_the_training_pool_and_the_warm_start(tmp_path):
    """eval.sets: a file of questions, some of which the generator also draws. Each set keeps its
    distinct questions (first row of each, at most its size), every one of them leaves the
    training pool and the warm start, and the measured overlap is 0 per set."""
    from training_core.config import load_spec
    from training_core.data.datasets import load_run_data, question_key, warm_start_rows

    run = ["data.options={max_value: 9, max_terms: 2}", "data.size=3000", "data.eval_size=10",
           "eval.size=10"]
    plain_spec = load_spec(None, run)  # the same run without the set
    plain = load_data(plain_spec.data, plain_spec.seed)
    shared = sorted({r["question"] for r in plain.train})[:12]  # training would draw them
    rows = [{"q": q, "a": "0"} for q in shared] + [{"q": shared[0], "a": "0"}]  # one copy
    path = _write_jsonl(tmp_path / "extra.jsonl", rows)
    spec = load_spec(None, [*run, f"eval.sets=[{{name: extra, source: 'jsonl:{path}', "
                            "question_field: q, answer_field: a}]"])
    data = load_run_data(spec)
    assert list(data.eval_sets) == ["heldout", "extra"]
    assert len(data.eval_sets["extra"]) == 10  # 12 distinct, eval.size bounds it
    assert data.overlap == {"heldout": 0.0, "extra": 0.0}
    trained = {question_key(r["question"]) for r in data.train}
    assert not trained & {question_key(q) for q in shared[:10]}
    assert question_key(shared[11]) in trained  # beyond the set's size: still trained on
    warm = {question_key(r["question"])
            for r in warm_start_rows(spec.data, spec.seed, named={"extra": data.eval_sets["extra"]})}
    assert warm and not warm & {question_key(q) for q in shared[:10]}
    # Control: without the set, those questions are in the pool.
    assert plain.eval == data.eval
    assert {question_key(q) for q in shared[:10]} <= {question_key(r["question"]) for r in plain.train}


def test_an_eval_set_is_a_named_file_never_the_runs_own_split():
    from training_core.config import SpecError, load_spec

    for sets, field_text in [
        ("[{name: heldout, source: 'jsonl:x.jsonl'}]", "run's own held-out split"),
        ("[{name: Bad Name, source: 'jsonl:x.jsonl'}]", "eval.sets.0.name"),
        ("[{name: gen, source: 'synthetic:arithmetic'}]", "a file of questions"),
        ("[{name: a, source: 'jsonl:x'}, {name: a, source: 'jsonl:y'}]", "unique"),
    ]:
        with pytest.raises(SpecError, match=field_text.replace("(", r"\(")):
            load_spec(None, [f"eval.sets={sets}"])


def test_a_missing_eval_set_file_names_its_set(tmp_path):
    from training_core.config import load_spec
    from training_core.data.datasets import load_run_data

    spec = load_spec(None, [f"eval.sets=[{{name: gone, source: 'jsonl:{tmp_path}/no.jsonl'}}]"])
    with pytest.raises(DatasetError, match=r"eval.sets\[0\] \(gone\).*does not exist"):
        load_run_data(spec)

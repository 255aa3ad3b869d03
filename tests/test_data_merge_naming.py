"""Issue 28 item 6: ``data.merge`` names its output as ``data.preprocess`` does
(``<prefix>_<key>_document``) when its inputs carry that suffix, and prints the --data-path."""

from data.merge import main, output_name
from tests.data_helpers import write_token_dataset


def test_output_name_follows_preprocess():
    shards = ["d/shard0_text_document", "d/shard1_text_document"]
    assert output_name(shards, "out/all") == "out/all_text_document"
    assert output_name(shards, "out/all_text_document") == "out/all_text_document"  # as given
    assert output_name(["a_title_sentence", "b_title_sentence"], "m") == "m_title_sentence"
    # no common suffix (other keys, or names preprocess did not write): written as given
    assert output_name(["a_text_document", "b_title_document"], "m") == "m"
    assert output_name(["x", "y"], "m") == "m"


def test_merge_writes_the_suffixed_pair_and_names_the_data_path(tmp_path, capsys):
    for i in range(2):
        write_token_dataset(tmp_path / f"s{i}_text_document", [[1, 2, 3]] * (i + 1))
    main(["--input", str(tmp_path / "s0_text_document"), str(tmp_path / "s1_text_document"),
          "--output-prefix", str(tmp_path / "all")])
    assert (tmp_path / "all_text_document.bin").exists()
    assert (tmp_path / "all_text_document.idx").exists() and not (tmp_path / "all.bin").exists()
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"3 documents, 9 tokens; train with --data-path "
                                 f"{tmp_path / 'all_text_document'}")

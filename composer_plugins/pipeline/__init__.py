"""The DVC pipeline: one module per stage, the study (variants x seeds) and its paired statistics and report.

``common`` (what the stages share: paths, JSONL, located params errors); one module per stage:
``stage_prepare``, ``stage_rollout``, ``stage_replay``, ``stage_pairs``, ``stage_train``, ``stage_eval``,
``stage_report`` (``stages`` re-exports their public names); ``study`` (variants x seeds, names, params
merging); ``stats`` (paired effects, Holm, curve AUC, time to threshold with censoring) and ``paired``
(the paired tables and report of a study directory); ``gap`` (the student-teacher gap predictor);
``plots`` (one dvc.yaml's plots, rendered offline); ``compare`` (tables of MLflow runs); ``plugin`` (the
``prepare``/``rollout``/``pairs``/``study``/``report``/``plots``/``compare`` commands).
"""

"""The three passes: analysis, profile, search (installed as ``cfp.passes``)."""

#!/usr/bin/env bash
# gpt: analysis, profile and search (or one pass with --mode). E.g.
#   sh cfp_test/gpt/gpt_test.sh --num_layer 2 --batch_size 8 --device_num 8 --mode analysis
exec bash "$(dirname "$0")/../run_model.sh" gpt "$@"

"""The main job (AR, dynamic confidence decoding and S2D2 on real prompts), as a script.

Same as `hf-dllm-spec main [args]` and `./run.sh main [args]`; the code is `hf_dllm_spec.tools.jobs.main`
(install the package first: `pip install -e ".[examples]"`).
"""

from hf_dllm_spec.tools.jobs.main import main

if __name__ == "__main__":
    main()

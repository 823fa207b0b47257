"""On-policy chat data: every assistant turn replaced by the target model's own response.

`turns` reads the chat rows and builds each round's prompts, `engines` answers them (vLLM in
process, or an OpenAI-compatible server), `row_log` keeps finished rows so a killed run resumes,
and `run` drives the rounds. `speculators regenerate` is the command line of `run_regeneration`.
"""

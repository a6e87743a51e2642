//! `tutti-demo-agent`: the bundled demo ACP agent (see `tutti_tokio::agents::demo`).

fn main() -> std::process::ExitCode {
    tutti_tokio::agents::run_demo_agent()
}

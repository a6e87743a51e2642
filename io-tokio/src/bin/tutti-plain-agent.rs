//! `tutti-plain-agent`: the bundled plain ACP agent (see `tutti_tokio::agents::plain`).

fn main() -> std::process::ExitCode {
    tutti_tokio::agents::run_plain_agent()
}

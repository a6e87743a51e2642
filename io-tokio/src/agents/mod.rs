//! The bundled ACP agents, built with the `agent-client-protocol` crate: `demo` delegates to
//! subagents advertised through the subagents extension; `plain` is root-only. `tuttid
//! demo-agent` / `tuttid plain-agent` and the `tutti-*-agent` binaries run them on stdio.

pub mod demo;
pub mod plain;

fn block_on(
    f: impl std::future::Future<Output = std::process::ExitCode>,
) -> std::process::ExitCode {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(f),
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Runs the demo agent on stdio.
pub fn run_demo_agent() -> std::process::ExitCode {
    block_on(demo::serve())
}

/// Runs the plain agent on stdio.
pub fn run_plain_agent() -> std::process::ExitCode {
    block_on(plain::serve())
}

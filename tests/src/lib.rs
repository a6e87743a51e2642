//! Shared helpers for the cross-crate tests.

pub mod acp_agents;
pub mod acp_wire;
pub mod browser;
pub mod claude_client;
pub mod claude_install;
pub mod codex_client;
pub mod conformance;
pub mod daemon;
pub mod fault_proxy;
pub mod mock_messages;
pub mod mock_responses;
pub mod openapi;
pub mod postgres;
pub mod procs;
pub mod providers;
pub mod sim;

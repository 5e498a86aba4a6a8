//! HTTP, server side and client side.
//!
//! [`server`] serves one client connection (HTTP/1 with parking of idle keep-alive
//! connections, or HTTP/2) and drains it; [`io`] is the client socket as hyper sees it, and
//! [`header_block`] bounds an HTTP/2 header block in progress. [`service`] forwards each
//! request, with [`headers`] (framing checks, hop-by-hop headers, the request target) and
//! [`body`] (streamed bodies, their bounds and accounting), through [`client`]: the pooled
//! connections towards the route's target ([`response_head`] tells apart the causes of a
//! response head hyper's client calls too large). [`context`] is what one connection's parts share.

mod body;
mod client;
mod context;
mod ending;
mod h1;
mod header_block;
mod headers;
mod io;
mod policy;
mod response_head;
mod retry;
mod server;
mod service;

pub(crate) use client::Upstream;
pub(crate) use context::HttpVersion;
pub(crate) use server::serve;

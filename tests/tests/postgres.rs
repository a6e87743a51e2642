//! PostgreSQL: the store conformance suite against a real server (started in a temporary
//! directory by [`tutti_tests::postgres::Server`]), and several writers on one database.

use tutti_postgres::PostgresStore;
use tutti_tests::postgres::Server;

#[test]
fn postgres_store_conforms() {
    let server = Server::fast().expect("postgres server");
    tutti_tests::conformance::run(
        || PostgresStore::connect(&server.create_database().expect("db")).expect("connect"),
        |s| {
            // The URL is not kept by the store: reopen by the database's name.
            let url = current_url(&server, &s);
            drop(s);
            PostgresStore::connect(&url).expect("reconnect")
        },
    );
}

fn current_url(server: &Server, s: &PostgresStore) -> String {
    server.url(&s.database_name().expect("database name"))
}

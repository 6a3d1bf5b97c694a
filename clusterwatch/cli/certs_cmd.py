"""``clusterwatch certs init|issue``: a trial CA and node certificates for mutual TLS.

Enough to try TLS on a few machines (clusterwatch.cli.certs); production uses
certificates from the site's own PKI, which this prints as a reminder.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from clusterwatch.runtime.cert_terms import CA_DAYS, LEAF_DAYS, Role

if TYPE_CHECKING:
    from clusterwatch.cli.certs import WrittenFiles

DEFAULT_DIR = Path("clusterwatch-certs")
PKI_REMINDER = (
    "note: this CA is for trying clusterwatch out; in production use certificates from your site's own PKI"
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "certs",
        help="make a trial CA (init) and certificates signed by it (issue) for mutual TLS",
        description="init: a self-signed CA in DIR (ca.crt, ca.key). issue NAME --role ROLE: a certificate "
        "for NAME signed by that CA, whose URI SAN clusterwatch://ROLE/NAME says who holds it: agents "
        "(--role node, NAME is the node id), people and tools (--role user; admins are named in "
        "admin_names) and the coordinator (--role coordinator, with --san for each host name or IP agents "
        "dial). For trying clusterwatch out: in production, use your site's own PKI.",
    )
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    _add_init(actions)
    _add_issue(actions)
    return parser


def _add_init(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = actions.add_parser(
        "init",
        help="make a CA: DIR/ca.crt and DIR/ca.key",
        description="Make a self-signed CA (EC P-256) that signs node certificates. Keep ca.key off the "
        "nodes: whoever holds it can mint certificates the coordinator trusts.",
    )
    _add_dir(parser)
    parser.add_argument("--days", type=int, default=CA_DAYS, help=f"days the CA is valid (default {CA_DAYS})")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing CA (certificates it signed stop being trusted)",
    )
    parser.set_defaults(run=run_init)


def _add_issue(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = actions.add_parser(
        "issue",
        help="make DIR/NAME.crt and DIR/NAME.key, signed by DIR's CA",
        description="Make a certificate for NAME (a node id, the coordinator's name, or an admin name), "
        "usable as both TLS server and client, signed by the CA `certs init` made in DIR.",
    )
    parser.add_argument("name", metavar="NAME", help="the node id, user (admin) name or coordinator name")
    parser.add_argument(
        "--role",
        required=True,
        choices=[role.value for role in Role],
        help="what the holder is, written as the URI SAN clusterwatch://ROLE/NAME: node (an agent; may "
        "report as node NAME only), user (a person or tool; reads the API, acts when NAME is in "
        "admin_names) or coordinator (serves the API)",
    )
    _add_dir(parser)
    parser.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME_OR_IP",
        help="another host name or IP address the certificate is valid for (repeatable); the "
        "coordinator's needs every name and IP agents dial, e.g. --san 127.0.0.1; *.DOMAIN covers "
        "every name one label under DOMAIN (the pods of a Kubernetes headless Service)",
    )
    parser.add_argument(
        "--days",
        type=int,
        default=LEAF_DAYS,
        help=f"days the certificate is valid, at most as long as the CA (default {LEAF_DAYS})",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing NAME.crt and NAME.key")
    parser.set_defaults(run=run_issue)


def _add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help=f"directory of the CA and certificates (default ./{DEFAULT_DIR})",
    )


def run_init(args: argparse.Namespace) -> int:
    from clusterwatch.cli import certs  # needs cryptography (the coordinator extra)

    written = certs.create_ca(args.dir, days=args.days, force=args.force)
    print(f"wrote {written.cert_path} (CA certificate, valid until {_date(written)})")
    print(f"wrote {written.key_path} (CA private key, mode 0600: keep it off the nodes)")
    print(
        f"next: clusterwatch certs issue NAME --role node|user|coordinator --dir {shlex.quote(str(args.dir))}"
    )
    print(PKI_REMINDER)
    return 0


def run_issue(args: argparse.Namespace) -> int:
    from clusterwatch.cli import certs  # needs cryptography (the coordinator extra)

    written = certs.issue(
        args.dir, args.name, role=Role(args.role), extra_sans=args.san, days=args.days, force=args.force
    )
    ca_cert, _ = certs.ca_paths(args.dir)
    print(f"wrote {written.cert_path} ({', '.join(written.names)}; valid until {_date(written)})")
    print(f"wrote {written.key_path} (private key, mode 0600)")
    flags = {"--tls-cert": written.cert_path, "--tls-key": written.key_path, "--tls-ca": ca_cert}
    print("use: " + " ".join(f"{flag} {shlex.quote(str(path))}" for flag, path in flags.items()))
    print(PKI_REMINDER)
    return 0


def _date(written: WrittenFiles) -> str:
    return written.not_after.strftime("%Y-%m-%d %H:%M UTC")

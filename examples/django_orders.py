"""Django: an order and its workflow run in one ``transaction.atomic()`` block.

``cyclone_dsl.contrib.django.submit_tx(workflow, input)`` writes the run on Django's
own connection (the ``postgresql`` backend on psycopg 3), in the current atomic
block: the order and its run are committed together, or, when the block raises,
neither exists. In a project, the settings live in settings.py and the worker runs
as ``python manage.py cyclone_worker shop.workflows``; this script configures Django
in place and runs a worker in background threads.
"""

from __future__ import annotations

from cyclone_dsl import NodeRef, Ref, step, workflow


@step(name="dj_reserve")
def reserve(order: dict[str, object]) -> dict[str, object]:
    return {**order, "reserved": True}


@step(name="dj_ship")
def ship(order: dict[str, object]) -> str:
    return f"order {order['order_id']}: {order['qty']} x {order['sku']} shipped"


@workflow(name="dj_fulfil")
def fulfil(order: Ref[dict[str, object]]) -> NodeRef[str]:
    return ship(reserve(order))


class OutOfStock(Exception):
    pass


if __name__ == "__main__":
    # Django ships no type hints: under mypy --strict its names are Any.
    import django  # type: ignore[import-untyped]
    from django.conf import settings  # type: ignore[import-untyped]

    from cyclone_dsl import RunNotFound, Worker, embedded_database, migrate
    from cyclone_dsl.contrib.django import database_settings, get_client, submit_tx

    with embedded_database() as dsn:
        settings.configure(
            INSTALLED_APPS=["cyclone_dsl.contrib.django"],
            DATABASES={"default": database_settings(dsn)},
            USE_TZ=True,
        )
        django.setup()
        from django.db import connection, models, transaction  # type: ignore[import-untyped]

        class Order(models.Model):  # type: ignore[misc]
            sku = models.CharField(max_length=40)
            qty = models.IntegerField()

            class Meta:
                app_label = "shop"
                db_table = "dj_example_orders"

        migrate(dsn)
        if Order._meta.db_table not in connection.introspection.table_names():
            with connection.schema_editor() as editor:
                editor.create_model(Order)

        with transaction.atomic():
            order = Order.objects.create(sku="sku-1", qty=2)
            placed = submit_tx(fulfil, {"order_id": order.id, "sku": order.sku, "qty": order.qty})
        # committed: the order and its run

        try:
            with transaction.atomic():
                order = Order.objects.create(sku="sku-2", qty=1000)
                refused = submit_tx(fulfil, {"order_id": order.id, "sku": "sku-2", "qty": 1000})
                raise OutOfStock("sku-2")
        except OutOfStock:
            pass
        # rolled back: neither the order nor its run exists
        assert not Order.objects.filter(id=order.id).exists()
        try:
            get_client().get_run(refused.id)
            raise AssertionError("the run of a rolled-back transaction exists")
        except RunNotFound:
            print(f"run {refused.id} was rolled back with order {order.id}")

        with Worker(dsn, [fulfil]):
            print(placed.result(timeout=30))
        connection.close()
